"""lm-evaluation-harness `local-completions` against a real `zcode serve` (slow).

Two small local tasks (no dataset hub here): a multiple-choice task, scored by loglikelihood
(token-id prompts, `echo` + `logprobs`, several prompts per request, concurrent requests), and
a greedy generation task. lm-eval finds the server's /tokenizer_info and /tokenize and uses them
instead of a local tokenizer.
"""

import json

import pytest
from remote_server import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MULTIPLE_CHOICE = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid"], 0),
    ("The capital of Germany is", ["Rome", "Berlin", "Lisbon"], 1),
    ("The capital of Italy is", ["Oslo", "Vienna", "Rome"], 2),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Newton"], 0),
    ("The opposite of hot is", ["cold", "blue", "fast"], 0),
    ("One plus one equals", ["seven", "two", "nine"], 1),
]
QUESTIONS = [("What is the capital of France?", "Paris"), ("What color is the sky?", "blue")]

TASKS = """task: zcode_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
{body}"""
MC_BODY = """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_BODY = """output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(root) -> None:
    mc = [
        {"question": q, "choices": [" " + c for c in choices], "answer": a}
        for q, choices, a in MULTIPLE_CHOICE
    ]
    gen = [{"question": q, "answer": a} for q, a in QUESTIONS]
    for name, rows, body in (("mc", mc, MC_BODY), ("gen", gen, GEN_BODY)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (root / f"{name}.yaml").write_text(TASKS.format(name=name, data=data, body=body))


def test_lm_eval_local_completions(tmp_path, monkeypatch):
    import lm_eval  # a declared test dependency: a missing install must fail, not skip
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_tasks(tmp_path)
    with RemoteServer("--kv-cache-mib", "128", "--max-model-len", "1024") as server:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(
                f"model={MODEL},base_url={server.base_url}/v1/completions,"
                "num_concurrent=4,max_retries=1"
            ),
            tasks=["zcode_mc", "zcode_gen"],
            batch_size=2,
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )
        m = server.metrics()
    assert results["results"]["zcode_mc"]["acc,none"] >= 5 / 6
    answers = [s["resps"][0][0] for s in results["samples"]["zcode_gen"]]
    assert len(answers) == 2 and "Paris" in answers[0]
    # every loglikelihood request and every generation went through the server
    assert m['zcode:request_success_total{finished_reason="length"}'] >= 18
