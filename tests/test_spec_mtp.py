"""Speculative decoding with GLM's MTP layer (zcode/spec/mtp.py) on tiny glm4_moe and glm_moe_dsa
checkpoints with one MTP layer (tiny_models.mtp_configs).

The drafts are checked against a reference written here from the checkpoint file alone, in
float64, without paging or the engine: the target's final hidden states from transformers, the
MTP layer's decoder layer as transformers builds it for a model one layer deeper (read from the
same file), and the MTP arithmetic (enorm, hnorm, eh_proj, shared head, chaining) written out.
The outputs are checked token for token against plain decoding and transformers.

Random MTP weights draft tokens the target almost never takes. The "agreeable" copy of a
checkpoint scales every decoder layer's output projections down and makes eh_proj pass the
embedding through, so the MTP layer drafts what the target mostly decodes next: drafts are both
kept and rejected, and the layers still move the logits far beyond the tolerances here.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_decode import (
    BLOCK,
    GREEDY,
    assert_drafts_were_tested,
    assert_no_blocks_held,
    oracle_greedy,
    prompts,
    run,
)
from tiny_models import mtp_configs
from transformers import AutoConfig, AutoModelForCausalLM

from zcode.errors import ValidationError
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams
from zcode.server.metrics import Metrics

NAMES = list(mtp_configs())
# Every request drafts its num_draft_tokens: these tests count drafts (see test_spec_decode.py).
ENGINE_ARGS = dict(
    kv_cache_bytes=1 << 20, block_size=BLOCK, speculative="mtp", draft_policy="fixed"
)
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def agreeable(tiny_checkpoint, tmp_path_factory):
    """name -> path of the agreeable copy of that tiny MTP checkpoint."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            source, target = tiny_checkpoint(name).path, tmp_path_factory.mktemp(f"{name}_agree")
            for file in source.glob("*.json"):
                shutil.copy(file, target)
            tensors = load_file(source / "model.safetensors")
            for key, value in tensors.items():
                if key.endswith(OUTPUT_PROJECTIONS):
                    tensors[key] = value * 0.2
                elif key.endswith("eh_proj.weight"):
                    hidden_size = value.shape[0]
                    identity = torch.eye(hidden_size)
                    tensors[key] = torch.cat([identity, 0.2 * identity], 1) + value * 0.2
            save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
            built[name] = target
        return built[name]

    return get


# ---- the reference -------------------------------------------------------------------------------


class MtpReference:
    """Draft logits of the MTP layer from the checkpoint file, float64, no cache: every step runs
    the layer over all pairs (token j, hidden state at j - 1), j = 1 .. the drafted position."""

    def __init__(self, path: Path) -> None:
        config = AutoConfig.from_pretrained(path)
        self.num_layers, self.eps = config.num_hidden_layers, config.rms_norm_eps
        self.target = self._load(path, config)
        values = {k: v for k, v in config.to_dict().items() if not k.endswith("layer_types")}
        values.pop("indexer_types", None)
        deeper_config = type(config)(**(values | {"num_hidden_layers": self.num_layers + 1}))
        self.block = self._load(path, deeper_config).model.layers[self.num_layers]
        prefix = f"model.layers.{self.num_layers}."
        tensors = load_file(path / "model.safetensors")
        self.mtp = {
            k.removeprefix(prefix): v.double()
            for k, v in tensors.items()
            if k.startswith(prefix) and k.removeprefix(prefix).startswith(("e", "h", "shared"))
        }

    @staticmethod
    def _load(path: Path, config):
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            attn_implementation="eager",
            experts_implementation="eager",
            dtype=torch.float64,
        )
        return model.eval()

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    @torch.no_grad()
    def draft_logits(self, token_ids: list[int], draft_ids: list[int]) -> torch.Tensor:
        """Logits [len(draft_ids), V] of each draft position after `token_ids`, the chain fed
        with `draft_ids` (the engine's drafts, so a near tie cannot fork the comparison)."""
        out = self.target(torch.tensor([token_ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # [n, D]: after the final norm
        embed, head = self.target.model.embed_tokens.weight, self.target.lm_head.weight
        inputs = list(token_ids[1:])  # pairs (token j, hidden j - 1), j = 1 .. n - 1
        previous = hidden[:-1]
        logits = []
        for draft in draft_ids:
            x = (
                torch.cat(
                    [
                        self.rms(embed[inputs], self.mtp["enorm.weight"]),
                        self.rms(previous, self.mtp["hnorm.weight"]),
                    ],
                    dim=-1,
                )
                @ self.mtp["eh_proj.weight"].T
            )
            y = self.block_forward(x, positions=torch.arange(1, len(inputs) + 1))
            carried = self.rms(y, self.mtp["shared_head.norm.weight"])
            logits.append(carried[-1] @ head.T)
            inputs.append(draft)
            previous = torch.cat([previous, carried[-1:]])  # the chain carries the normed output
        return torch.stack(logits)

    def block_forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]
        causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
        rope = self.target.model.rotary_emb(x[None], positions[None])
        out = self.block(
            x[None],
            attention_mask=causal[None, None],
            position_ids=positions[None],
            position_embeddings=rope,
        )
        return (out[0] if isinstance(out, tuple) else out)[0]


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """(tokens, drafts, draft logits [k, V]) of each sequence at each proposal from now on."""
    drafter = llm.engine.drafter
    records, logits_seen = [], []
    propose, logits = drafter.propose, drafter.mtp.logits

    def recording_logits(hidden):
        out = logits(hidden)
        logits_seen.append(out)
        return out

    def recording_propose(seqs, max_num_tokens):
        logits_seen.clear()
        tokens = [list(seq.token_ids) for seq in seqs]
        drafts = propose(seqs, max_num_tokens)
        per_seq = [[] for _ in seqs]
        for step, step_logits in enumerate(logits_seen):  # rows leave as their drafts run out
            live = [i for i, n in enumerate(max_num_tokens) if n > step]
            for row, i in enumerate(live):
                per_seq[i].append(step_logits[row])
        for ids, drafted, rows in zip(tokens, drafts, per_seq):
            if drafted:
                records.append((ids, drafted, torch.stack(rows)))
        return drafts

    drafter.propose = recording_propose
    drafter.mtp.logits = recording_logits
    return records


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_draft_logits_match_the_reference(name, agreeable):
    """Prompts of different lengths in one batch, blocks of 4 (drafts cross block boundaries),
    then prompts that extend the first outputs, so their MTP context comes from the prefix cache."""
    path = agreeable(name)
    reference = MtpReference(path)
    llm = LLM(path, **ENGINE_ARGS, num_draft_tokens=3)
    records = record_proposals(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = run(llm.engine, [(ids, params) for ids in prompts()[:3]])
    hits = llm.engine.block_manager.prefix_cache_hits
    run(llm.engine, [(first[1].prompt_token_ids + first[1].token_ids + [7], params)])
    assert llm.engine.block_manager.prefix_cache_hits > hits
    assert_drafts_were_tested(llm.engine)
    assert len(records) > 15
    for tokens, drafts, logits in records:
        want = reference.draft_logits(tokens, drafts)
        torch.testing.assert_close(logits.double(), want, rtol=1e-4, atol=1e-4)
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1e-3
        assert (want.argmax(-1) == torch.tensor(drafts))[clear].all()


# ---- exactness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [NAMES[0], pytest.param(NAMES[1], marks=pytest.mark.slow)])
def test_greedy_outputs_are_those_of_transformers(name, tiny_checkpoint):
    """Random MTP weights: drafts are rejected (nearly) always."""
    checkpoint = tiny_checkpoint(name)
    llm = LLM(checkpoint.path, **ENGINE_ARGS, num_draft_tokens=2)
    outputs = llm.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs, strict=True):
        assert out.token_ids == oracle_greedy(checkpoint.oracle, prompt, GREEDY.max_tokens)
        assert out.plan.speculative["method"] == "mtp"
        assert out.plan.speculative["num_draft_tokens"] > 0
    totals = llm.engine.spec_totals
    print(f"{name} random MTP weights: {totals}")
    metrics = Metrics("m")
    metrics.engine_stats(llm.engine.stats())
    drafted = 'zcode:spec_decode_num_draft_tokens_total{model_name="m"} '
    assert f"{drafted}{float(totals['num_draft_tokens'])}" in metrics.render().decode()
    assert_no_blocks_held(llm.engine)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_and_prefix_cache_match_plain_decoding(name, agreeable):
    """Speculating requests beside one that does not, split prefills, a stop token, then a
    second wave whose prompts reuse blocks written around kept and rejected drafts."""
    path = agreeable(name)
    engine_args = dict(kv_cache_bytes=1 << 20, block_size=BLOCK, max_num_batched_tokens=16)
    spec = LLM(path, speculative="mtp", num_draft_tokens=3, draft_policy="fixed", **engine_args)
    spec = spec.engine
    plain = LLM(path, enable_prefix_caching=False, **engine_args).engine
    first = [
        (ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, num_draft_tokens=k))
        for ids, n, k in zip(prompts(), (16, 9, 20, 13), (None, 0, 1, None))
    ]
    stop = run(plain, first[:1])[0].token_ids[5]
    first.append(
        (prompts()[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))
    )
    want = run(plain, [(ids, dataclasses.replace(p, num_draft_tokens=None)) for ids, p in first])
    got = run(spec, first)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].plan is None  # num_draft_tokens=0: it never speculated
    second = [(o.prompt_token_ids + o.token_ids + [7], GREEDY) for o in got]
    hits_before = spec.block_manager.prefix_cache_hits
    assert [o.token_ids for o in run(spec, second)] == [o.token_ids for o in run(plain, second)]
    assert spec.block_manager.prefix_cache_hits > hits_before
    assert_drafts_were_tested(spec)
    assert_no_blocks_held(spec)
    totals = spec.spec_totals
    print(f"{name} agreeable MTP: {totals['num_accepted_tokens']} of {totals['num_draft_tokens']}")


@pytest.mark.parametrize("name", NAMES)
def test_the_mtp_caches_are_inside_kv_cache_bytes(name, tiny_checkpoint):
    """The MTP layer's KV and the target's hidden states share the KV's blocks and its budget:
    the blocks handed out, all caches counted, fit kv_cache_bytes (one padding block beside)."""
    engine = LLM(tiny_checkpoint(name).path, **ENGINE_ARGS).engine
    owners = engine.model.attention_layers() + engine.drafter.cache_owners()
    per_block = sum(t[0].nbytes for m in owners for t in m.cache.values())
    total = sum(t.nbytes for m in owners for t in m.cache.values())
    assert total == (engine.runner.num_blocks + 1) * per_block
    assert engine.runner.num_blocks * per_block <= ENGINE_ARGS["kv_cache_bytes"]
    assert (engine.runner.num_blocks + 1) * per_block > ENGINE_ARGS["kv_cache_bytes"]


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "message"), [("llama", "llama has none"), ("glm4_moe", "no MTP")])
def test_a_model_without_mtp_layers_is_refused(name, message, tiny_checkpoint):
    with pytest.raises(ValidationError, match=message):
        LLM(tiny_checkpoint(name).path, **ENGINE_ARGS)


@pytest.mark.parametrize(
    ("option", "message"), [("compile", "compile"), ("per_request_depth", "per_request_depth")]
)
def test_options_the_mtp_caches_do_not_follow_yet_are_refused(option, message, tiny_checkpoint):
    with pytest.raises(NotImplementedError, match=message):
        LLM(tiny_checkpoint(NAMES[0]).path, **ENGINE_ARGS, **{option: True})


def test_mtp_config_is_written_with_the_layer(tiny_checkpoint):
    """The tiny checkpoints carry what a GLM checkpoint does: num_nextn_predict_layers 1 and the
    layer's tensors past the decoder layers."""
    path = tiny_checkpoint(NAMES[0]).path
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    names = load_file(path / "model.safetensors").keys()
    layer = config["num_hidden_layers"]
    for own in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "mlp.gate"):
        assert f"model.layers.{layer}.{own}.weight" in names
