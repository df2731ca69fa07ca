"""docs/config.md is the schema's: written from the dataclasses' comments, defaults and ranges, and kept equal
to them here."""
import dataclasses
import re

from megazero.config import ranges, reference
from megazero.config.reference import PAGE, field_comments, missing_comments, page, sections


def test_the_page_is_the_schemas():
    assert PAGE.read_text() == page(), \
        "docs/config.md differs from the schema: run `python -m megazero.config.reference --write`"


def test_every_key_has_a_comment():
    assert missing_comments() == [], "keys without a comment in their dataclass (their documentation)"


def test_every_key_is_on_the_page_with_its_valid_values():
    text = page()
    rows = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| (.*)$", text, re.M))
    keys = [f"{name}.{f.name}" for name, cls in sections() for f in dataclasses.fields(cls)]
    assert set(rows) == set(keys) and len(keys) > 100, sorted(set(keys) ^ set(rows))
    for value in ranges.choices("optim", "name"):
        assert f"`{value}`" in rows["optim.name"].split(" | ")[1], rows["optim.name"]
    assert "1 … 2^31-1" in rows["model.layers"]


@dataclasses.dataclass
class _Example:
    # above, first line
    # above, second line
    a: int = 1  # at the end
    b: int = 2
    c: str = "#not a comment"  # the comment
    # a comment on an unrelated line

    d: int = 3


def test_comments_are_read_from_above_and_the_end_of_a_line():
    assert field_comments(_Example) == {"a": "above, first line above, second line at the end", "b": "",
                                        "c": "the comment", "d": ""}


def test_the_command_writes_the_page(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "PAGE", tmp_path / "config.md")
    reference.main(["--write"])
    assert (tmp_path / "config.md").read_text() == page()
