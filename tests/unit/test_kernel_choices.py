"""engine.kernels.kernel_choices: the tuner's choices on disk come back as stored (tuples as tuples), only within their
scope (card and versions), merged across writers, and an unreadable file is ignored then replaced."""

from __future__ import annotations

from corolla.engine.kernels.kernel_choices import FILE_NAME, KernelChoices


def test_choices_round_trip_within_their_scope_and_merge_across_writers(tmp_path) -> None:
    one = KernelChoices(tmp_path, "H200|torch 2.11")
    other = KernelChoices(tmp_path, "H200|torch 2.11")  # read before `one` stored anything
    one.put("quant nf4 256x1024", {"best": ("stream", (64, 4, 4, 4, 2)), "mid_best": None, "best_us": 9.5})
    other.put("linear 256x1024", {"best": (8, 512, 4, 3)})
    again = KernelChoices(tmp_path, "H200|torch 2.11")
    assert again.get("quant nf4 256x1024") == {"best": ("stream", (64, 4, 4, 4, 2)), "mid_best": None, "best_us": 9.5}
    assert again.get("linear 256x1024") == {"best": (8, 512, 4, 3)}  # the second writer kept the first's entry
    assert again.get("quant int8 256x1024") is None
    assert KernelChoices(tmp_path, "H100|torch 2.11").get("linear 256x1024") is None


def test_an_unreadable_file_is_ignored_and_replaced(tmp_path) -> None:
    (tmp_path / FILE_NAME).write_text("{not json")
    choices = KernelChoices(tmp_path, "scope")
    assert choices.get("p") is None
    choices.put("p", [1, [2, 3]])
    assert KernelChoices(tmp_path, "scope").get("p") == (1, (2, 3))
