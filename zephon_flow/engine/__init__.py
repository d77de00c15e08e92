"""The engine: the spec, the embedded Loader and the tools that run it (simulation, inspection, end agreement)."""
