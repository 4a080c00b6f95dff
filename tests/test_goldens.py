"""The reference engine against llama.cpp's goldens on the default model and its llama relabel.

One model in memory at a time: each module-scoped model is dropped before the next loads.
"""
from __future__ import annotations

import gc
import os

import pytest

from engine.tools import greedy32
from engine.reference.model import ReferenceModel
from engine.tools.relabel import relabel_architecture
from engine.text.tokenizer import load_tokenizer

GOLDENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goldens", "llamacpp")
QWEN = os.path.join(GOLDENS, "qwen2.5-coder-1.5b-q4_k_m.json")
LLAMA = os.path.join(GOLDENS, "qwen-as-llama-1.5b-q4_k_m.json")

pytestmark = pytest.mark.model


def check(model, golden_path, eog):
    cases = greedy32.load_goldens(golden_path)
    teacher = greedy32.run(model, cases, eog, min_margin=0.5, teacher=True)
    print(greedy32.format_rows(teacher))
    compared = sum(r.compared for r in teacher)
    total = sum(len(c["tokens"]) for c in cases)
    assert all(r.ok for r in teacher), greedy32.format_rows(teacher)
    assert compared >= 0.8 * total  # most steps have margin >= 0.5
    free = greedy32.run(model, cases, eog, min_margin=0.5)
    print(greedy32.format_rows(free))
    assert all(r.ok for r in free), greedy32.format_rows(free)


@pytest.fixture(scope="module")
def models(default_model_path, tmp_path_factory):
    """Yields (name, model, golden) one at a time, freeing each before the next loads."""
    eog = load_tokenizer(default_model_path).eog_ids
    relabeled = str(tmp_path_factory.mktemp("relabel") / "qwen-as-llama.gguf")

    def load(which):
        if which == "llama":
            relabel_architecture(default_model_path, relabeled, "llama")
            return ReferenceModel.from_path(relabeled)
        return ReferenceModel.from_path(default_model_path)

    yield load, eog
    if os.path.exists(relabeled):
        os.remove(relabeled)


def test_default_model_matches_llama_cpp_goldens(models):
    load, eog = models
    model = load("qwen2")
    assert model.config.rope_type == "neox"
    try:
        check(model, QWEN, eog)
    finally:
        del model
        gc.collect()


def test_llama_relabel_matches_llama_cpp_goldens(models):
    load, eog = models
    model = load("llama")
    assert model.config.arch == "llama" and model.config.rope_type == "normal"
    try:
        check(model, LLAMA, eog)
    finally:
        del model
        gc.collect()
