"""Where LoRA adapters may be read from over HTTP (`allowed_lora_root`), and the command line's
`name=folder` form of lora_paths."""

from __future__ import annotations

import os

import pytest

from deploy.app import allowed_lora_path
from engine.errors import InvalidRequestError
from engine.flags import parse_mapping


def test_a_folder_under_the_root_is_allowed_and_a_link_out_of_it_is_not(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "adapter_config.json").write_text("{}")
    assert allowed_lora_path(str(root / "a"), str(root)) == os.path.realpath(root / "a")
    (outside / "secret.safetensors").write_text("x")
    os.symlink(outside / "secret.safetensors", root / "a" / "adapter_model.safetensors")
    with pytest.raises(InvalidRequestError, match="link that leads out") as e:
        allowed_lora_path(str(root / "a"), str(root))
    assert e.value.param == "lora_path"
    for bad in (str(outside), str(root / "a" / ".." / ".." / "outside"), "a"):
        with pytest.raises(InvalidRequestError, match="not an absolute path under"):
            allowed_lora_path(bad, str(root))


def test_mapping_flags_take_pairs_whose_text_values_stay_text():
    assert parse_mapping("a=/x/a,b=true c=12") == {"a": "/x/a", "b": "true", "c": 12}
    assert parse_mapping('{"load_weight": 0.2}') == {"load_weight": 0.2}
    assert parse_mapping("load_weight=0.2") == {"load_weight": 0.2}


def test_lora_under_tp_keeps_the_ranks_on_one_node():
    """Every rank reads an adapter's folder itself: a placement that may spread the ranks over
    nodes is refused with LoRA on."""
    from cluster.config import ClusterConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="STRICT_PACK"):
        ClusterConfig(model_path="m", tp_size=2, tp_placement_strategy="SPREAD", engine={"enable_lora": True})
    ClusterConfig(model_path="m", tp_size=2, engine={"enable_lora": True})
    ClusterConfig(model_path="m", tp_size=2, tp_placement_strategy="SPREAD")  # no adapters: any placement
