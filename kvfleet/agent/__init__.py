"""The kvfleet serving agent: supervises the engine, proxies its routes, publishes the scaling signals,
drains on shutdown, sheds load by tokens and isolates prefix-cache reuse per tenant."""
