"""Stubs generated from proto/zephon/v1/ by scripts/gen_proto.py: never edited by hand."""
