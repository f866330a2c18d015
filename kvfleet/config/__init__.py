"""Environment files: the schema (``schema``, ``targets``) and the loader with line numbers (``loader``).

Parsed once at the edge into validated frozen objects; everything after this layer receives those objects.
"""
