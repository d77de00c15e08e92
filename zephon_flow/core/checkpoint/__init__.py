"""The checkpoint format: what a checkpoint holds, how it is encoded, and how it is read back.

- ``state``: the typed states (``LoaderState``, ``LaneState``, ``StageState``, ``FeedCursor``,
  ``SourceCursor``) and their plain-data form, checked on every read;
- ``store``: a ``LoaderState`` as bytes and as a file (encode, decode, save, load);
- ``merge``: the union of several ranks' states;
- ``framed_file``: the file of format 3, written and read lane by lane, optionally incremental;
- ``frame_encode`` / ``frame_decode``: the compact encoding of one frame (a lane's state);
- ``derived_fields``: the contract by which an operator says which fields a checkpoint rebuilds
  (codecs handed in by the plan, never registered); ``packed_segments``: Pack's, the format's own;
- ``window_check``: the digest of each lane's next window, which a resume verifies;
- ``blob``: the single-blob codec of formats 1 and 2 (still read) and the canonical digest of
  a state.
"""

from __future__ import annotations

#: The checkpoint format written today (``framed_file``: compact frames, narrowed integers,
#: element lists as columns without derived fields, zstd, lane by lane, optionally
#: incremental). Formats 1 and 2 were single blobs (``blob.BLOB_VERSION``) and are still read;
#: a checkpoint of a newer format is refused.
FORMAT_VERSION = 3
