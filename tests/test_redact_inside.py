"""Redaction looks inside objects and strings.

How it could break, and what each test tries: an object the flattener turns into text
(``argparse.Namespace`` nested in a config, a dataclass, any ``repr``) would carry a
secret the key rule never sees; a credential inside a longer string (a header, a URL, a
command line) would pass the whole-value rule. Namespaces and dataclasses are flattened
into keys first; every string is searched for credential shapes, hidden where they
stand, the rest kept. Words that only look alike (``max_new_tokens``, a git SHA under
``commit``, a URL without a password) stay as logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import types

import pytest

from ranklog.producer._values import flatten_params

WANDB = "0123456789abcdef0123456789abcdef01234567"
HF = "hf_" + "a1B2c3D4e5F6g7H8i9J0kLmN"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJlX2hlcmVfb2s"


def test_a_nested_namespace_is_flattened_and_its_secrets_hidden() -> None:
    """``{"args": Namespace(wandb_key=..., hf=...)}``: keys ``args.*``, no secret in clear."""
    ns = argparse.Namespace(wandb_key=WANDB, hf=HF, lr=0.1, inner=types.SimpleNamespace(x=1))
    got = flatten_params({"args": ns})
    assert got == {"args.wandb_key": "<redacted>", "args.hf": "<redacted>", "args.lr": 0.1,
                   "args.inner.x": 1}  # fmt: skip


def test_an_objects_text_is_redacted_by_the_same_rules() -> None:
    """An object shipped as its text: the credentials in it hidden, the rest kept."""

    class Opaque:
        def __repr__(self) -> str:
            return f"Opaque(token={HF}, key={WANDB}, lr=0.1)"

    @dataclasses.dataclass
    class Cfg:
        api_key: str = WANDB
        depth: int = 3

    got = flatten_params({"o": Opaque(), "cfg": Cfg()})
    assert got["o"] == "Opaque(token=<redacted>, key=<redacted>, lr=0.1)"
    assert got["cfg.api_key"] == "<redacted>" and got["cfg.depth"] == 3


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (f"Bearer {JWT}", "Bearer <redacted>"),
        (JWT, "<redacted>"),
        ("postgresql://user:s3cr3t-pw@db:5432/x", "postgresql://user:<redacted>@db:5432/x"),
        (f"train.py --lr 0.1 --hf={HF}", "train.py --lr 0.1 --hf=<redacted>"),
        (f"login --key={WANDB} --quiet", "login --key=<redacted> --quiet"),
        ("sk-" + "x" * 30 + " is mine", "<redacted> is mine"),
        ("PGPASSWORD=hunter22 psql", "PGPASSWORD=<redacted> psql"),
        ('{"password": "hunter22x"}', '{"password": "<redacted>"}'),
        ("Basic dXNlcjpwYXNzd29yZA==", "Basic <redacted>"),
        ("/home/u/hf_token=abcd1234/x", "/home/u/hf_token=<redacted>/x"),
    ],
)
def test_credentials_inside_a_string_are_hidden_where_they_stand(value: str, shown: str) -> None:
    """A header, a URL, a command line: the credential hidden, the rest of the text kept."""
    assert flatten_params({"text": value}) == {"text": shown}
    assert flatten_params({"texts": [value]}) == {"texts": [shown]}


@pytest.mark.parametrize(
    "value",
    ["https://github.com/org/repo.git", "max_new_tokens=512 temperature=0.7",
     "a plain description of the run", f"checkout {WANDB[:12]}", "Basic arithmetic questions",
     "we use token embeddings", "Token classification with bert-base", "auth: kerberos",
     "pad_token: <pad>, unk_token: <unk>}", "max_token=2048", "token: 5",
     "time 12:30:00 ok"],
)  # fmt: skip
def test_what_only_looks_alike_stays(value: str) -> None:
    """No password in a URL, a model's tokens, plain words: shipped as logged."""
    assert flatten_params({"text": value}) == {"text": value}
    assert flatten_params({"commit": WANDB}) == {"commit": WANDB}
