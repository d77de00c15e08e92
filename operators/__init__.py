"""Built-in operators: sources, tokenization, mixing, packing, shuffling and function wrappers (Beam)."""

from zephon_flow.operators.jsonl import ReadJsonl
from zephon_flow.operators.map import Filter, FlatMap, Map
from zephon_flow.operators.mix import Mix
from zephon_flow.operators.pack import Pack
from zephon_flow.operators.parquet import ReadParquet
from zephon_flow.operators.shuffle import Shuffle
from zephon_flow.operators.splits import Source
from zephon_flow.operators.tokenize import Tokenize

__all__ = [
    "Filter",
    "FlatMap",
    "Map",
    "Mix",
    "Pack",
    "ReadJsonl",
    "ReadParquet",
    "Shuffle",
    "Source",
    "Tokenize",
]
