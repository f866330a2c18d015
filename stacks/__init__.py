"""CDK stacks and constructs. ``stacks.config`` parses environment files without importing CDK."""
