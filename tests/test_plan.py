import pytest

from zcode.calibration import SPLITS, corpus_text
from zcode.harness import ExecutionPlan


def test_signature_ignores_the_name_and_tracks_the_work():
    dense = ExecutionPlan()
    assert ExecutionPlan(name="renamed").signature() == dense.signature()
    int8 = ExecutionPlan(precision=(("lm_head", "int8"),))
    assert int8.signature() != dense.signature()
    assert ExecutionPlan(ffn_density=0.5).signature() != dense.signature()
    assert ExecutionPlan(skip_layers=(3,)).signature() != dense.signature()


def test_density_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="ffn_density"):
        ExecutionPlan(ffn_density=0.0)


def test_calibration_and_heldout_text_share_no_file():
    assert not set(SPLITS["calibration"]) & set(SPLITS["heldout"])
    assert "def " in corpus_text("heldout")
    with pytest.raises(ValueError, match="unknown split"):
        corpus_text("train")
