"""The routing predictor (issue 17, item 5): reads a prompt and predicts its quality loss under
each of a few candidate depths, so the planner gives inputs that lose little cheaper plans.

What it routes: skipped-layer sets, the k least important layers for k in the router's list
(importance: the log-perplexity increase of skipping one layer alone, measured on calibration
text). They need an engine with `per_request_depth`, where a request skips layers as data.

What it reads (no forward pass: the plan must be chosen before the prompt runs): the prompt's
mean input embedding (what its tokens are), the fraction of its n-grams (n = 1..4) that occurred
earlier in it (how much of it repeats, which attention copies from context rather than
predicts) and the log of its length, standardized. A ridge regression maps those features to
each depth's log-perplexity increase on this input: (D + 6) x K weights (the features and an
intercept), under 0.01% of SmolLM2-135M's parameters.

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

RIDGE_PENALTIES = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
NGRAM_ORDERS = (1, 2, 3, 4)  # repeated n-gram fractions among the features
SCHEMA = 2  # 2: features without a principal-component projection, repeated n-grams added


@dataclass(frozen=True)
class Router:
    depths: tuple[tuple[int, ...], ...]  # the skipped-layer sets it predicts for, sorted
    mean_log_loss: tuple[float, ...]  # each depth's mean on the calibration windows
    feature_mean: torch.Tensor  # [F] of the calibration windows' prompt_features
    feature_scale: torch.Tensor  # [F]
    weights: torch.Tensor  # [F + 1, K]: standardized features and 1 -> log loss per depth

    def predict_features(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, F] (prompt_features) -> [N, K] predicted log-perplexity increases
        (nats/token, >= 0)."""
        z = (features - self.feature_mean) / self.feature_scale
        return (torch.cat([z, torch.ones(len(z), 1)], dim=1) @ self.weights).clamp(min=0.0)

    def predict(self, embeddings: torch.nn.Module, token_ids: list[int]) -> list[float]:
        """This prompt's predicted log-perplexity increase under each depth (nats/token)."""
        return self.predict_features(prompt_features(embeddings, [token_ids]))[0].tolist()

    @property
    def num_parameters(self) -> int:
        return sum(getattr(self, name).numel() for name in TENSORS)

    def state(self) -> dict:
        """Plain lists and tensors, as the calibration artifact stores them."""
        depths = [list(d) for d in self.depths]
        blob = {"schema": SCHEMA, "depths": depths, "mean_log_loss": list(self.mean_log_loss)}
        return blob | {name: getattr(self, name) for name in TENSORS}

    @classmethod
    def from_state(cls, blob: dict) -> "Router":
        try:
            if blob["schema"] != SCHEMA:
                raise ValueError("written by another version of zcode: run `zcode calibrate` again")
            return cls(
                tuple(tuple(d) for d in blob["depths"]),
                tuple(blob["mean_log_loss"]),
                *(torch.as_tensor(blob[name]) for name in TENSORS),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValidationError(f"the calibration artifact's router is unreadable: {e}") from None


TENSORS = ("feature_mean", "feature_scale", "weights")


def repeated_fractions(ids: list[int]) -> list[float]:
    """For each n in NGRAM_ORDERS, the fraction of the prompt's n-grams seen earlier in it (0
    where it has none)."""
    out = []
    for n in NGRAM_ORDERS:
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        seen, repeated = set(), 0
        for gram in grams:
            repeated += gram in seen
            seen.add(gram)
        out.append(repeated / len(grams) if grams else 0.0)
    return out


def prompt_features(embeddings: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """[N, D + len(NGRAM_ORDERS) + 1]: each prompt's mean input embedding (fp32), its repeated
    n-gram fractions and its log length (last)."""
    rows = []
    with torch.inference_mode():
        for ids in prompts:
            mean = embeddings(torch.tensor(ids, dtype=torch.int64)).float().mean(0)
            text = torch.tensor(repeated_fractions(ids) + [math.log(len(ids))])
            rows.append(torch.cat([mean, text]))
    return torch.stack(rows)


def fit(features: torch.Tensor, losses: torch.Tensor, depths, penalties=RIDGE_PENALTIES) -> Router:
    """features [N, F] (prompt_features), losses [N, K] log-perplexity increases -> the ridge
    router whose penalty has the least leave-one-out error."""
    mean, scale = features.mean(0), features.std(0).clamp(min=1e-6)
    z = torch.cat([(features - mean) / scale, torch.ones(len(features), 1)], dim=1).double()
    y = losses.double()  # [N, K]
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
    return Router(tuple(depths), mean_loss, mean, scale, best[1].float())


def window_log_losses(llm, windows: list[list[int]], depths, starts=(1,)) -> torch.Tensor:
    """[S, N, K]: each window's log-perplexity increase under each depth over no skipping, over
    its tokens from position starts[s] on (each predicted from all before it): one pass per
    depth serves every start."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)

    def mean_nll(skip: tuple[int, ...]) -> torch.Tensor:  # [S, N]
        outs = llm.generate(windows, params, skip_layers=skip)
        # each window's negative log-likelihood of its tokens 1.. (token 0 has no prediction)
        nll = [
            [-out.prompt_logprobs[i][w[i]] for i in range(1, len(w))]
            for w, out in zip(windows, outs)
        ]
        return torch.tensor(
            [[sum(row[start - 1 :]) / (len(row) + 1 - start) for row in nll] for start in starts]
        )

    dense = mean_nll(())
    zeros = torch.zeros(len(starts), len(windows))
    return torch.stack([mean_nll(d) - dense if d else zeros for d in depths], 2)


def layer_order(llm, windows: list[list[int]]) -> list[int]:
    """Decoder layers, least important first: by the mean log-perplexity increase of skipping
    each one alone on `windows`."""
    num_layers = len(llm.model.model.layers)
    (single,) = window_log_losses(llm, windows, [(i,) for i in range(num_layers)])  # [N, L]
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
    (losses,) = window_log_losses(llm, windows, depths)
    return fit(prompt_features(llm.model.model.embed_tokens, windows), losses, depths)
