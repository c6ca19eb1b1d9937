"""Recipes and their numbers as untrusted input (issue 42, the smaller problems): ``calibrate --recipe``
with a file that is not a recipe, and ``activation_memory`` numbers that are not finite."""

from __future__ import annotations

import math

import pytest
from _paths import ROOT
from _timing import scaled

from lightning_adaptiveload.cli.calibrate import _recipe_defaults
from lightning_adaptiveload.models.memory import ActivationMemory

_BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(f"{x}: &{x} [{','.join([f'*{p}'] * 9)}]" for p, x in zip("abcdefgh", "bcdefghi")),
        "model: *i",
        "data: *i",
        "trainer: *i",
    ]
)


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "- a\n- b\n",
            "the recipe must be a mapping (key: value lines), got a list",
        ),  # before: AttributeError
        (_BOMB, "expand to more than 65536 values"),  # a billion laughs; before: AttributeError
        ("a: &a [*a]\nmodel: {}\n", "contains itself"),
        ("model: " + "[" * 5000 + "]" * 5000, "nested too deeply"),
        ("model:\n  init_args: [1, 2]\n", "model.init_args must be a mapping"),
        ("trainer: 5\n", "trainer must be a mapping"),
        ("trainer:\n  precision: [bf16]\n", "trainer.precision must be a string"),
        ("model: {a: 1\n", "not valid YAML"),
    ],
)
@pytest.mark.timeout(scaled(120))
def test_calibrate_recipe_errors_name_the_recipe(tmp_path, text, words):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:  # the timeout bounds the time (a bomb expanded would take hours)
        _recipe_defaults(str(path))
    assert f"--recipe {path}" in str(err.value) and words in str(err.value), str(err.value)


def test_calibrate_recipe_still_reads_a_real_recipe():
    import os

    recipe = os.path.join(ROOT, "recipes", "quickstart.yaml")
    assert isinstance(_recipe_defaults(recipe), dict)


_GOOD = {
    "num_blocks": 30,
    "base_bytes": 2e10,
    "token_all": 1e5,
    "text_all": 2e5,
    "token_block": 8e4,
    "text_block": 1e4,
}


@pytest.mark.parametrize(
    "key, value",
    [
        ("base_bytes", math.nan),
        ("token_all", math.inf),
        ("text_block", -1.0),
        ("num_blocks", 0),
        ("base_bytes", "x"),
    ],
)
def test_activation_memory_numbers_must_be_finite(key, value):
    """Before: a NaN base was accepted (every budget comparison with it is False)."""
    with pytest.raises(ValueError, match=rf"activation_memory: .*{key}"):
        ActivationMemory.from_dict({**_GOOD, key: value})
    assert ActivationMemory.from_dict(_GOOD).base_bytes == 2e10
