"""Built-in operators: sources, tokenization, mixing, packing and shuffling, as Beam transforms."""

from zephon_flow.operators.arrow import ReadArrow
from zephon_flow.operators.jsonl import ReadJsonl
from zephon_flow.operators.mix import Mix
from zephon_flow.operators.pack import Pack
from zephon_flow.operators.parquet import ReadParquet
from zephon_flow.operators.shuffle import Shuffle
from zephon_flow.operators.splits import Source
from zephon_flow.operators.text_files import ReadTextFiles
from zephon_flow.operators.tokenize import Tokenize
from zephon_flow.operators.webdataset import ReadWebDataset

__all__ = [
    "Mix",
    "Pack",
    "ReadArrow",
    "ReadJsonl",
    "ReadParquet",
    "ReadTextFiles",
    "ReadWebDataset",
    "Shuffle",
    "Source",
    "Tokenize",
]
