"""The routing predictor (issue 17, item 5): reads a prompt and predicts its quality loss under
each of a few candidate depths, so the planner gives inputs that lose little cheaper plans.

What it routes: skipped-layer sets, the k least important layers for k in the router's list
(importance: the log-perplexity increase of skipping one layer alone, measured on calibration
text). They need an engine with `per_request_depth`, where a request skips layers as data.

What it reads: the mean input embedding of the prompt's tokens (no forward pass: the plan must be
chosen before the prompt runs), projected on the calibration windows' top principal directions
(NUM_COMPONENTS), and the log of its length, standardized. A ridge regression maps those features
to each depth's log-perplexity increase on this input. Its parameters (the projection, D x 16,
and (16 + 2) x K weights) are under 0.01% of SmolLM2-135M's.

Fitted by `fit_router` on calibration windows: each window's measured log-perplexity increase
under each depth (prompt log-probs through the engine, the skips per request, all windows of one
depth in one batch), the ridge penalty chosen by leave-one-out error on the same windows.
`zcode calibrate` fits it into the calibration artifact (zcode.sparsity.artifact: `router`, its
`state()`); an LLM loaded with that artifact and `per_request_depth` routes by it.
bench/bench_router.py judges it on held-out text against the best static depth at equal cost.
"""

import math
from dataclasses import dataclass

import torch

from zcode.errors import ValidationError
from zcode.sampling_params import SamplingParams

RIDGE_PENALTIES = (0.1, 1.0, 10.0, 100.0, 1000.0)
NUM_COMPONENTS = 16
SCHEMA = 1


@dataclass(frozen=True)
class Router:
    depths: tuple[tuple[int, ...], ...]  # the skipped-layer sets it predicts for, sorted
    mean_log_loss: tuple[float, ...]  # each depth's mean on the calibration windows
    center: torch.Tensor  # [D] the calibration windows' mean embedding
    projection: torch.Tensor  # [D, Q] their top principal directions
    feature_mean: torch.Tensor  # [Q + 1]
    feature_scale: torch.Tensor  # [Q + 1]
    weights: torch.Tensor  # [Q + 2, K]: standardized features and 1 -> log loss per depth

    def features(self, raw: torch.Tensor) -> torch.Tensor:
        """raw [N, D + 1] (prompt_embeddings) -> [N, Q + 1]: projected, and the log length."""
        return torch.cat([(raw[:, :-1] - self.center) @ self.projection, raw[:, -1:]], dim=1)

    def predict_raw(self, raw: torch.Tensor) -> torch.Tensor:
        """raw [N, D + 1] -> [N, K] predicted log-perplexity increases (nats/token, >= 0)."""
        z = (self.features(raw) - self.feature_mean) / self.feature_scale
        return (torch.cat([z, torch.ones(len(z), 1)], dim=1) @ self.weights).clamp(min=0.0)

    def predict(self, embeddings: torch.nn.Module, token_ids: list[int]) -> list[float]:
        """This prompt's predicted log-perplexity increase under each depth (nats/token)."""
        return self.predict_raw(prompt_embeddings(embeddings, [token_ids]))[0].tolist()

    @property
    def num_parameters(self) -> int:
        return (
            sum(
                t.numel()
                for t in (self.center, self.projection, self.feature_mean, self.feature_scale)
            )
            + self.weights.numel()
        )

    def state(self) -> dict:
        """Plain lists and tensors, as the calibration artifact stores them."""
        depths = [list(d) for d in self.depths]
        blob = {"schema": SCHEMA, "depths": depths, "mean_log_loss": list(self.mean_log_loss)}
        return blob | {name: getattr(self, name) for name in TENSORS}

    @classmethod
    def from_state(cls, blob: dict) -> "Router":
        try:
            if blob["schema"] != SCHEMA:
                raise ValueError("written by another version of zcode")
            return cls(
                tuple(tuple(d) for d in blob["depths"]),
                tuple(blob["mean_log_loss"]),
                *(torch.as_tensor(blob[name]) for name in TENSORS),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValidationError(f"the calibration artifact's router is unreadable: {e}") from None


TENSORS = ("center", "projection", "feature_mean", "feature_scale", "weights")


def prompt_embeddings(embeddings: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """[N, D + 1]: each prompt's mean input embedding (fp32) and log length."""
    rows = []
    with torch.inference_mode():
        for ids in prompts:
            mean = embeddings(torch.tensor(ids, dtype=torch.int64)).float().mean(0)
            rows.append(torch.cat([mean, torch.tensor([math.log(len(ids))])]))
    return torch.stack(rows)


def fit(
    raw: torch.Tensor,
    losses: torch.Tensor,
    depths,
    num_components: int = NUM_COMPONENTS,
    penalties=RIDGE_PENALTIES,
) -> Router:
    """raw [N, D + 1] (prompt_embeddings), losses [N, K] log-perplexity increases -> the ridge
    router on the top principal directions whose penalty has the least leave-one-out error."""
    center = raw[:, :-1].mean(0)
    q = min(num_components, len(raw) - 1, raw.shape[1] - 1)
    _, _, projection = torch.pca_lowrank(raw[:, :-1] - center, q=q, center=False)  # [D, q]
    x = torch.cat([(raw[:, :-1] - center) @ projection, raw[:, -1:]], dim=1)
    mean, scale = x.mean(0), x.std(0).clamp(min=1e-6)
    z = torch.cat([(x - mean) / scale, torch.ones(len(x), 1)], dim=1).double()  # [N, q + 2]
    y = losses.double()
    best = None
    for penalty in penalties:
        reg = penalty * torch.eye(z.shape[1], dtype=torch.float64)
        reg[-1, -1] = 0.0  # the intercept is not shrunk
        inverse = torch.linalg.inv(z.T @ z + reg)
        weights = inverse @ z.T @ y
        hat = (z @ inverse * z).sum(1, keepdim=True)  # leverage of each window
        loo = ((y - z @ weights) / (1 - hat)).pow(2).mean().item()
        if best is None or loo < best[0]:
            best = (loo, weights)
    mean_loss = tuple(losses.mean(0).tolist())
    return Router(tuple(depths), mean_loss, center, projection, mean, scale, best[1].float())


def window_log_losses(llm, windows: list[list[int]], depths, start: int = 1) -> torch.Tensor:
    """[N, K]: each window's log-perplexity increase under each depth over no skipping, over
    its tokens from position `start` on (each predicted from all before it)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)

    def mean_nll(skip: tuple[int, ...]) -> torch.Tensor:
        outs = llm.generate(windows, params, skip_layers=skip)
        return torch.tensor(
            [
                -sum(out.prompt_logprobs[i][w[i]] for i in range(start, len(w))) / (len(w) - start)
                for w, out in zip(windows, outs)
            ]
        )

    dense = mean_nll(())
    return torch.stack([mean_nll(d) - dense if d else torch.zeros(len(windows)) for d in depths], 1)


def layer_order(llm, windows: list[list[int]]) -> list[int]:
    """Decoder layers, least important first: by the mean log-perplexity increase of skipping
    each one alone on `windows`."""
    num_layers = len(llm.model.model.layers)
    single = window_log_losses(llm, windows, [(i,) for i in range(num_layers)])  # [N, L]
    return sorted(range(num_layers), key=lambda i: single[:, i].mean().item())


def fit_router(
    llm, windows: list[list[int]], skip_counts=(0, 1, 2, 4, 6), order_windows: int = 8
) -> Router:
    """The router for `llm` (an engine with per_request_depth) from calibration windows."""
    if llm.engine.runner.pages is None:
        raise ValidationError("a router routes skipped layers: load with per_request_depth=True")
    order = layer_order(llm, windows[:order_windows])
    counts = sorted({min(k, len(order) - 1) for k in skip_counts})  # a layer always runs
    depths = [tuple(sorted(order[:k])) for k in counts]
    losses = window_log_losses(llm, windows, depths)
    return fit(prompt_embeddings(llm.model.model.embed_tokens, windows), losses, depths)
