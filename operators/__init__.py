"""Built-in operators: sources, tokenization, mixing, packing, shuffling, images, video, function wrappers."""

from zephon_flow.core.source import Source
from zephon_flow.operators.arrow import ReadArrow
from zephon_flow.operators.image_decode import DecodeImage
from zephon_flow.operators.image_resize import ResizeImage
from zephon_flow.operators.jsonl import ReadJsonl
from zephon_flow.operators.map import Filter, FlatMap, Map
from zephon_flow.operators.mix import Mix
from zephon_flow.operators.pack import Pack
from zephon_flow.operators.pack_multimodal import PackMultimodal
from zephon_flow.operators.pack_video import PackVideo
from zephon_flow.operators.parquet import ReadParquet
from zephon_flow.operators.shuffle import Shuffle
from zephon_flow.operators.text_files import ReadTextFiles
from zephon_flow.operators.tokenize import Tokenize
from zephon_flow.operators.tokenize_field import TokenizeField
from zephon_flow.operators.video_decode import DecodeVideo
from zephon_flow.operators.video_source import ReadVideo
from zephon_flow.operators.webdataset import ReadWebDataset

__all__ = [
    "DecodeImage",
    "DecodeVideo",
    "Filter",
    "FlatMap",
    "Map",
    "Mix",
    "Pack",
    "PackMultimodal",
    "PackVideo",
    "ReadArrow",
    "ReadJsonl",
    "ReadParquet",
    "ReadTextFiles",
    "ReadVideo",
    "ReadWebDataset",
    "ResizeImage",
    "Shuffle",
    "Source",
    "Tokenize",
    "TokenizeField",
]
