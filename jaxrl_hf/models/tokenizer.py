"""Tokenizer: HF ``tokenizer.json`` (via the ``tokenizers`` library) + the model's jinja chat template.

The chat template is rendered the way ``transformers`` renders it: a sandboxed jinja2 environment
with ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not HTML-escape, ``raise_exception`` / ``strftime_now`` globals, and the special tokens
(``bos_token``, ``eos_token``, ...) passed as variables.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Sequence

Message = dict[str, Any]


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """Byte-level BPE tokenizer with chat template; ``encode`` adds no special tokens by default."""

    def __init__(self, backend: Any, tokenizer_config: dict[str, Any], source: str = "<memory>") -> None:
        self._tok = backend
        self.config = dict(tokenizer_config)
        self.source = source
        self.chat_template: str | None = self.config.get("chat_template")

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` from an HF directory."""
        from tokenizers import Tokenizer as Backend

        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        cfg_file = os.path.join(path, "tokenizer_config.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        template_file = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in cfg and os.path.isfile(template_file):
            with open(template_file) as f:
                cfg["chat_template"] = f.read()
        return cls(Backend.from_file(tok_file), cfg, source=path)

    # --- special tokens --------------------------------------------------------------------------
    def _special_id(self, key: str) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special_id("pad_token")
        return pad if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self._tok.id_to_token(int(idx))

    # --- encode / decode -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in the text map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.config.get("add_bos_token") and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.config.get("add_eos_token") and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return list(ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no special tokens added) and each token's ``(start, end)`` character span."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    # --- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                            tokenize: bool = False, chat_template: str | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the chat template (same output as ``transformers``); ids if ``tokenize``."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"tokenizer at {self.source} has no chat_template (tokenizer_config.json)")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"chat message {i} must be a dict with a 'role' key, got {message!r}")
        specials = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = self.config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                specials[key] = value
        rendered = _compile_template(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            **{**specials, **kwargs})
        return self.encode(rendered) if tokenize else rendered
