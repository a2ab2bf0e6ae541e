"""Which hyperparameters are secrets: shipped as ``<redacted>``, everything else as logged.

A key is split into components at ``.`` and ``/`` (``wandb.api_key``: ``wandb``,
``api_key``), and each component into words at ``_``, ``-``, spaces and camelCase
(``apiKey``: ``api``, ``key``). A component names a secret when

- one of its words is ``password``, ``passwd``, ``passphrase``, ``secret``, ``secrets``,
  ``credential``, ``credentials`` or ``apikey``; or it holds ``api key`` or ``private
  key`` (``wandb.api_key``, ``db_password``, ``aws_secret_access_key``);
- it is ``token``, or ends with ``token`` (``hf_token``, ``HFToken``, ``hub_token``,
  ``MLFLOW_TRACKING_TOKEN``, ``DATABRICKS_TOKEN``, ``CI_JOB_TOKEN``), unless the word
  before says it is one of a model's tokens (``pad_token``, ``eos_token``, ``bos_token``,
  ``unk_token``, ``mask_token``, ``image_token``, ``max_token``, ``first_token``...);

unless its last word says it names *where* a secret is (``env``, ``var``, ``file``,
``path``, ``dir``, ``name``: ``api_key_env_var``, ``password_file``). Words that merely
contain "token" are never secrets: ``max_new_tokens``, ``num_tokens``, ``tokenizer``,
``token_level_loss``, ``stop_token_ids``.

A string value is a secret, whatever its key, when it looks like a credential: a W&B API
key (40 hex digits, unless its key names a commit, sha, hash or revision: a git SHA), a
Hugging Face token (``hf_...``), an OpenAI key (``sk-...``), a GitHub token (``ghp_...``,
``github_pat_...``), a Slack token (``xox?-...``) or a JWT (``eyJ...``).

Inside a longer string (a database URL, a header, a command line, an object's text) the
same shapes are hidden where they stand and the rest of the string is kept
(:meth:`Redactor.text`): the password of a URL (``postgresql://user:<redacted>@host``), the
credentials after ``Bearer`` or ``Basic`` (12 or more characters with a digit or ``=``),
the value of ``name=value`` or ``name: value`` when the name is a secret's by the key rule
above (or ends with ``password``, ``passwd`` or ``secret``: ``PGPASSWORD=``), 40 hex digits
after ``key=``, and the token shapes above. So ``max_token=2048``, ``pad_token: <pad>``,
``auth: none`` and "Basic arithmetic" stay as logged.

Users add their own: ``ranklog.init(redact=["*.db_url", "private_*"])`` and the
environment variable ``RANKLOG_REDACT`` (comma-separated), shell globs matched, case
blind, against the whole dotted key and against each component.
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import re
from collections.abc import Iterable
from typing import Final

__all__ = ["REDACT_ENV", "Redactor", "redact_in_text", "redact_text"]

#: the environment variable with more globs of keys to redact (comma-separated)
REDACT_ENV: Final = "RANKLOG_REDACT"

_SPLIT: Final = re.compile(r"[._/\-\s]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_SECRET_WORDS: Final = frozenset(
    {"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials",
     "apikey"}
)  # fmt: skip
_SECRET_PAIRS: Final = frozenset({("api", "key"), ("private", "key")})
#: the words before "token" that make it one of a model's tokens, not a credential
_MODEL_TOKENS: Final = frozenset(
    {"pad", "eos", "bos", "unk", "mask", "sep", "cls", "start", "end", "stop", "begin",
     "image", "img", "video", "audio", "vision", "special", "additional", "think", "tool",
     "eot", "eom", "placeholder", "fim", "prefix", "suffix", "middle", "boi", "eoi",
     "max", "min", "num", "n", "per", "total", "first", "last", "next", "new", "prompt",
     "response", "input", "output", "generation", "gen", "sample", "target", "reasoning",
     "answer", "query", "label", "ignore", "class", "decoder", "encoder", "system",
     "assistant", "chat", "turn", "default", "extra", "vocab", "split", "boundary"}
)  # fmt: skip
#: a component whose last word is one of these names where a secret is, not the secret
_PLACES: Final = frozenset({"env", "var", "file", "path", "dir", "name"})
#: words of a key under which 40 hex digits are a git object, not a W&B key
_GIT_WORDS: Final = frozenset({"commit", "sha", "hash", "revision", "rev", "digest"})
_LOOKS_SECRET: Final = re.compile(
    r"hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_\w{20,}|xox[abposr]-[A-Za-z0-9\-]{10,}|eyJ[\w\-]{10,}\.[\w\-]{10,}\.[\w\-]+"
)
_HEX40: Final = re.compile(r"[0-9a-f]{40}")


#: credential shapes inside a longer string, each hidden where it stands (what names it kept)
_URL_PASSWORD: Final = re.compile(r"(?i)(\b[a-z][a-z0-9+.\-]*://[^\s/:@]+:)[^\s/@]+(?=@)")
#: an Authorization header's credentials: 12 or more characters with a digit or ``=`` (words
#: after "Basic" stay: "Basic arithmetic")
_HEADER: Final = re.compile(
    r"(?i)(\b(?:bearer|basic)\s+)(?=[A-Za-z0-9\-._~+/]*[0-9=])[A-Za-z0-9\-._~+/]{12,}=*"
)
#: 40 hex digits after ``key=`` (``wandb login --key=...``)
_KEY_HEX: Final = re.compile(r"(?i)((?<![\w.])key[\"']?\s*[=:]\s*[\"']?)[0-9a-f]{40}(?![0-9a-f])")
#: ``name=value`` and ``name: value`` (a quoted JSON key too): hidden when the name is a
#: secret's by the key rule (:func:`secret_component`; ``PGPASSWORD``, ``client_secret``)
_ASSIGNED: Final = re.compile(
    r"(?<![\w.])([A-Za-z_][\w.\-]*)([\"']?\s*[=:]\s*[\"']?)([^\s\"'&;,/}\])]{4,})"
)
_SHAPES: Final = re.compile(rf"(?<![\w-])(?:{_LOOKS_SECRET.pattern})")


def _assigned(m: re.Match[str]) -> str:
    name = m.group(1).rsplit(".", 1)[-1]
    low = name.lower()
    if secret_component(name) or low.endswith(("password", "passwd", "secret")) or low == "pwd":
        return m.group(1) + m.group(2) + "<redacted>"
    return m.group(0)


def redact_in_text(text: str) -> str:
    """``text`` with every credential shape in it hidden, the rest kept (see the module)."""
    text = _URL_PASSWORD.sub(r"\1<redacted>", text)
    text = _HEADER.sub(r"\1<redacted>", text)
    text = _KEY_HEX.sub(r"\1<redacted>", text)
    text = _ASSIGNED.sub(_assigned, text)
    return _SHAPES.sub("<redacted>", text)


def redact_text(text: str) -> tuple[str, int]:
    """``text`` with every credential-shaped token (``hf_...``, ``sk-...``, ``ghp_...``, a
    JWT ...; not 40 hex digits, which in code are mostly git objects) replaced by
    ``<redacted>``, and how many were."""
    return re.subn(rf"(?<![\w-])(?:{_LOOKS_SECRET.pattern})", "<redacted>", text)


def _words(component: str) -> list[str]:
    return [w.lower() for w in _SPLIT.split(component) if w]


def secret_component(component: str) -> bool:
    """Whether one component of a key names a secret (see the module docstring)."""
    words = _words(component)
    if not words or words[-1] in _PLACES:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words)):
        return True
    return words[-1] == "token" and (len(words) == 1 or words[-2] not in _MODEL_TOKENS)


class Redactor:
    """Decides which hyperparameters are shipped as ``<redacted>``."""

    def __init__(self, extra: Iterable[str] = (), *, env: bool = True) -> None:
        globs = [g.strip() for g in extra if g.strip()]
        if env:
            globs += [g.strip() for g in os.environ.get(REDACT_ENV, "").split(",") if g.strip()]
        self.globs = tuple(g.lower() for g in globs)

    def key(self, key: str) -> bool:
        """Whether the dotted ``key`` names a secret (built in, or a user's glob)."""
        parts = [p for p in re.split(r"[./]", key) if p]
        if any(secret_component(p) for p in parts):
            return True
        low = key.lower()
        return any(
            fnmatch.fnmatchcase(low, g) or any(fnmatch.fnmatchcase(p.lower(), g) for p in parts)
            for g in self.globs
        )

    def text(self, key: str, value: str) -> str:
        """The string ``value`` of ``key`` as shipped: ``<redacted>`` when it is a
        credential, else with the credentials inside it hidden (the rest kept)."""
        return "<redacted>" if self.value(key, value) else redact_in_text(value)

    def value(self, key: str, value: str) -> bool:
        """Whether the string ``value`` of ``key`` looks like a credential."""
        if _LOOKS_SECRET.fullmatch(value):
            return True
        if _HEX40.fullmatch(value):
            return not any(w in _GIT_WORDS for w in _words(key))
        return False
