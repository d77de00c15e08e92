"""``TokenizeField``: ``Tokenize`` applied to one field of dict samples, e.g. an image's caption."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import apache_beam as beam

from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.operators.image_decode import sample_name
from zephon_flow.operators.tokenize import Tokenize


class TokenizeField(beam.DoFn):  # type: ignore[misc]
    """Encodes ``element[field]`` (str, or bytes decoded as UTF-8) into ``element[output]``.

    The ids are exactly ``Tokenize``'s (same tokenizer file or folder, ``append_eos``,
    ``eos_token``, ``engine`` and ``add_special_tokens``; see there); the rest of the sample passes through. With ``keep_input=False``
    (the default) the text field is dropped from the output. A ``txt`` member of a WebDataset
    sample arrives as bytes; text that is not valid UTF-8 is a ``DataError`` naming the sample.
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str],
        *,
        field: str = "txt",
        output: str = "text_ids",
        append_eos: bool = True,
        eos_token: str | None = None,
        engine: str = "auto",
        keep_input: bool = False,
        add_special_tokens: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("field", field), ("output", output)):
            if not isinstance(value, str) or not value:
                raise SpecError(f"TokenizeField: {name} must be a non-empty string, got {value!r}")
        self.field = field
        self.output = output
        self.keep_input = bool(keep_input)
        self.tokenize = Tokenize(
            tokenizer,
            append_eos=append_eos,
            eos_token=eos_token,
            engine=engine,
            add_special_tokens=add_special_tokens,
        )

    def token_decoder(self) -> Callable[[list[int]], str]:
        """Ids back to text with the field's tokenizer (see ``Tokenize.token_decoder``)."""
        return self.tokenize.token_decoder()

    def params(self) -> dict[str, Any]:
        return {
            **self.tokenize.params(),
            "field": self.field,
            "output": self.output,
            "keep_input": self.keep_input,
        }

    def setup(self) -> None:
        self.tokenize.setup()

    def process(self, element: Any) -> Any:
        if not isinstance(element, Mapping):
            raise DataError(
                f"TokenizeField: expected a dict sample with a {self.field!r} field, got {type(element).__name__}"
            )
        name = sample_name(element)
        if self.field not in element:
            raise DataError(
                f"TokenizeField: {name} has no field {self.field!r} (it has {sorted(element)}); "
                f"set TokenizeField(field=...)"
            )
        text = element[self.field]
        if isinstance(text, bytes | bytearray | memoryview):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"TokenizeField: field {self.field!r} of {name} is not valid UTF-8 "
                    f"(byte {exc.start}: {exc.reason})"
                ) from exc
        elif not isinstance(text, str):
            raise DataError(
                f"TokenizeField: field {self.field!r} of {name} holds {type(text).__name__}, not text"
            )
        out = {k: v for k, v in element.items() if self.keep_input or k != self.field}
        (out[self.output],) = self.tokenize.process(text)
        yield out
