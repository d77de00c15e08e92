"""The exception hierarchy of zephon-flow: every error a user can see is one of these.

    ZephonError
     +-- SpecError            the pipeline, the spec or a topology is invalid (before any work)
     |    +-- UnsupportedTransformError   the runner cannot run a transform of the graph
     |    +-- UsageError                  the command line is wrong (the CLI exits 2)
     |    +-- RayUnavailableError         Ray is not installed, or its cluster cannot be reached
     +-- DataError            bad input: names the file, the offset or row, and the operator
     +-- StageError           a DoFn raised; carries the worker's traceback
     |    +-- WorkerLostError         a worker process died on the same chunk too many times
     |    +-- ChunkTimeoutError       a stateless call ran past the chunk deadline (chunk_timeout)
     +-- RankLostError        a peer rank failed, closed or stopped answering before the
     |                        ranks agreed on the end of a finite pass (names the rank)
     +-- StateError           a checkpoint cannot be used
          +-- FingerprintMismatchError    written for another pipeline (names the part)
          +-- LaneCountMismatchError      written for another lane count
          +-- FormatVersionError          written by a newer format
          +-- CorruptStateError           bytes or structure are damaged
          +-- StateConflictError          merged ranks disagree about a lane
          +-- RecipeRefusedError          state_mode="recipe" cannot store this pipeline's state
          +-- RecipeMismatchError         a recipe restore did not give back the saved sequences
          +-- ResumeMismatchError         a restored lane's first window is not the one recorded
     +-- ServiceError         the batch service refused a call or failed (carries its message)
     +-- OwnerError           a lane owner's pipeline failed, or a step it no longer holds was asked
     +-- OwnerLostError       a lane owner died and could not be replaced (names lanes and step)
     +-- CoordinatorLostError the lane owners' coordinator failed to start or died

Every class also derives from the builtin a caller would naturally catch (``ValueError``
for invalid input, ``RuntimeError`` for failures while running).
"""

from __future__ import annotations


class ZephonError(Exception):
    """Base class of every error raised by zephon-flow."""


class SpecError(ZephonError, ValueError):
    """The pipeline definition, the spec or the requested topology is invalid."""


class UnsupportedTransformError(SpecError):
    """The deterministic runner cannot run a transform of the graph."""


class DataError(ZephonError, ValueError):
    """Bad input data; the message names the file, the offset or row, and the operator."""


class StageError(ZephonError, RuntimeError):
    """A DoFn raised while processing; the message carries the original traceback."""


class WorkerLostError(StageError):
    """A worker process died (killed, out of memory, ``os._exit``) each time it ran the same
    chunk; names the worker, the lane, the operator and the record."""


class ChunkTimeoutError(StageError):
    """A stateless call ran longer than the loader's ``chunk_timeout``; names the DoFn and the
    record. On the processes backend the stuck worker has been killed and replaced."""


class RankLostError(ZephonError, RuntimeError):
    """A peer rank failed, closed or stopped answering before the ranks of a finite pass agreed
    on a step (``EndSync``); names the rank and the step, and the peer's own error if known."""


class StateError(ZephonError, ValueError):
    """A checkpoint (lane state) cannot be used."""


class FingerprintMismatchError(StateError):
    """The checkpoint was written for another pipeline."""


class LaneCountMismatchError(StateError):
    """The checkpoint was written for another number of lanes."""


class FormatVersionError(StateError):
    """The checkpoint was written by a newer checkpoint format."""


class CorruptStateError(StateError):
    """The checkpoint bytes or its structure are damaged."""


class StateConflictError(StateError):
    """States being merged disagree (different steps, or different contents for a lane)."""


class RecipeRefusedError(StateError):
    """``state_mode="recipe"`` cannot store this pipeline's state (names the operator or the
    source, and says to use the default ``state_mode="compact"``)."""


class RecipeMismatchError(StateError):
    """Re-reading a recipe state's documents did not give back a saved sequence bit for bit:
    the data, the tokenizer or a stateless DoFn changed since the checkpoint (names them)."""


class ResumeMismatchError(StateError):
    """A lane restored from a checkpoint made a first window other than the one the checkpoint
    recorded: the data, the tokenizer or an operator's output changed since it was saved
    (names the lane, the step and what changed; ``verify_resume=False`` accepts it knowingly)."""


class ServiceError(ZephonError, RuntimeError):
    """The batch service refused a request or could not be reached; carries the server's message.

    ``code`` is the gRPC status code name (e.g. ``"OUT_OF_RANGE"``), or ``""`` for errors found
    on the client side (a malformed message).
    """

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class UsageError(SpecError):
    """The command line itself is wrong: exit code 2, like argparse's own errors."""


class RayUnavailableError(SpecError):
    """Ray is not installed, or the cluster at the given address cannot be reached."""


class OwnerError(ZephonError, RuntimeError):
    """A lane owner's pipeline failed, or a step it was asked for is no longer held."""


class OwnerLostError(ZephonError, RuntimeError):
    """A lane owner died and could not be replaced; the message names its lanes and the step."""


class CoordinatorLostError(ZephonError, RuntimeError):
    """The lane owners' coordinator failed to start or died; its owners end with it, so the run
    resumes from its last checkpoint (the message names the coordinator and the call)."""


__all__ = [
    "ChunkTimeoutError",
    "CoordinatorLostError",
    "CorruptStateError",
    "DataError",
    "FingerprintMismatchError",
    "FormatVersionError",
    "LaneCountMismatchError",
    "OwnerError",
    "OwnerLostError",
    "RankLostError",
    "RayUnavailableError",
    "RecipeMismatchError",
    "RecipeRefusedError",
    "ResumeMismatchError",
    "ServiceError",
    "SpecError",
    "StageError",
    "StateConflictError",
    "StateError",
    "UnsupportedTransformError",
    "UsageError",
    "WorkerLostError",
    "ZephonError",
]
