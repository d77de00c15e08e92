"""Backends that run the stateless part of a pipeline: inline, threads, processes."""
