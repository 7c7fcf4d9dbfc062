"""Characters YAML does not allow (C0 controls, DEL, the noncharacters U+FFFE/U+FFFF, lone surrogates) in the UI's
YAML recipe helper: each is refused with 422 ``invalid_recipe`` naming the character and where it is, over a real
HTTP connection that stays open for the next request (PyYAML's reader checks them as the loader is built). So is a
value whose explicit tag PyYAML's constructor fails on with an error of its own (``!!timestamp x``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converters.errors import RecipeError
from converters.recipes import recipe_from_accelerate_yaml
from service.config import Settings
from tests.service_helpers import keepalive_requests, live_app

GOOD = "mixed_precision: fp8\nfp8_config:\n  backend: TE\n"
#: the issue's six, U+FFFF, and a lone surrogate (which a JSON body cannot carry as a string: that one is refused by
#: the request schema before the route, so it is tested on the parser alone)
CHARACTERS = ["\x00", "\x01", "\x7f", "\x1b", "\x0b", "\ufffe", "\uffff", "\ud800"]
SENT = CHARACTERS[:-1]
#: explicit tags whose constructor raises something other than a YAML error on a value that is not of that type
BAD_TAGS = ["!!timestamp x", "!!timestamp 2024-13-45", "!!float x", "!!int 0x"]


def _with(character: str) -> str:
    return GOOD.replace("backend: TE", f"backend: T{character}E")


@pytest.mark.parametrize("character", CHARACTERS)
def test_the_parser_refuses_the_character_naming_it_and_its_place(character: str) -> None:
    with pytest.raises(RecipeError) as caught:
        recipe_from_accelerate_yaml(_with(character))
    message = caught.value.message
    assert f"U+{ord(character):04X}" in message and "line 3, column 13" in message, message
    assert character not in message


@pytest.mark.parametrize("tagged", BAD_TAGS)
def test_a_tagged_value_its_constructor_cannot_read_is_refused(tagged: str) -> None:
    with pytest.raises(RecipeError) as caught:
        recipe_from_accelerate_yaml(GOOD + f"  margin: {tagged}\n")
    assert "cannot be read" in caught.value.message or "Not valid YAML" in caught.value.message, caught.value.message


def test_each_character_gets_422_on_a_connection_that_survives(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, workers=0)
    requests = [("POST", "/ui/api/recipe-from-yaml", {"yaml": _with(character)}) for character in SENT]
    requests += [("POST", "/ui/api/recipe-from-yaml", {"yaml": GOOD + f"  margin: {tagged}\n"}) for tagged in BAD_TAGS]
    requests.append(("POST", "/ui/api/recipe-from-yaml", {"yaml": GOOD}))
    with live_app(settings) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1])
        answers = keepalive_requests(port, requests)
    for character, (status, body) in zip(SENT, answers, strict=False):
        assert status == 422, (repr(character), status, body)
        error = body["error"]
        assert error["code"] == "invalid_recipe" and error["field"] == "yaml", (repr(character), body)
        assert f"U+{ord(character):04X}" in error["message"] and "remove it" in error["message"], body
        assert len(json.dumps(body)) < 1000
    for tagged, (status, body) in zip(BAD_TAGS, answers[len(SENT):], strict=False):
        assert status == 422 and body["error"]["code"] == "invalid_recipe", (tagged, status, body)
    assert answers[-1][0] == 200 and answers[-1][1]["recipe"]["backend"] == "te", answers[-1]
