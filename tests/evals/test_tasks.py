"""Local task YAMLs load offline through lm-eval, in fixed order, from the resolved data dir."""

from __future__ import annotations

import os

import pytest

from evals import data

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
TASKS_DIR = data.REPO_ROOT / "evals" / "tasks"

# Item counts from shared/data/README.md (62 = WikiText-2 test articles).
EXPECTED_COUNTS = {
    "driftgate_arc_easy": 2376,
    "driftgate_arc_challenge": 1172,
    "driftgate_hellaswag": 10042,
    "driftgate_piqa": 1838,
    "driftgate_winogrande": 1267,
    "driftgate_gsm8k_cot": 1319,
    "driftgate_wikitext": 62,
}


@pytest.fixture(scope="module")
def task_dict(data_dir):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(data_dir)})
    return manager.load(sorted(EXPECTED_COUNTS))["tasks"]


def test_every_task_loads_with_its_full_item_count_and_a_version(task_dict):
    assert set(task_dict) == set(EXPECTED_COUNTS)
    for name, task in task_dict.items():
        assert len(list(task.test_docs())) == EXPECTED_COUNTS[name], name
        assert task.VERSION == 1.0


def test_item_order_is_the_file_order(task_dict, data_dir):
    arc = list(task_dict["driftgate_arc_easy"].test_docs())
    assert [d["query"] for d in arc[:5]] == [d["query"] for d in data.load_arc(data_dir, "easy")[:5]]
    hs = list(task_dict["driftgate_hellaswag"].test_docs())
    assert [d["idx"] for d in hs[:100]] == list(range(100))


def test_prompts_render_as_documented(task_dict):
    arc = task_dict["driftgate_arc_challenge"]
    doc = next(iter(arc.test_docs()))
    assert arc.doc_to_text(doc).startswith("Question: ") and arc.doc_to_text(doc).endswith("\nAnswer:")
    assert arc.doc_to_choice(doc) == doc["choices"]
    wino = task_dict["driftgate_winogrande"]
    doc = next(iter(wino.test_docs()))
    # Multiple-input mode: the int text selects the gold context, the continuation is shared.
    assert wino.doc_to_text(doc) == doc["gold"]
    assert wino.doc_to_target(doc) == doc["continuation"]


def test_gsm8k_prompt_has_eight_inline_exemplars_and_a_numeric_target(task_dict):
    task = task_dict["driftgate_gsm8k_cot"]
    doc = next(iter(task.test_docs()))
    prompt = task.fewshot_context(doc, num_fewshot=8)
    assert prompt.count("Q: ") == 9
    assert prompt.count("The answer is") == 8
    assert prompt.endswith(f"Q: {doc['question']}\nA:")
    assert task.doc_to_target(doc) == doc["answer"].split("####")[-1].strip()


def test_piqa_labels_are_joined(data_dir):
    docs = data.load_piqa(data_dir)
    labels = (data_dir / "piqa" / "valid-labels.lst").read_text().split()
    assert [d["label"] for d in docs] == [int(x) for x in labels]


def test_wikitext_splits_articles_and_undoes_number_markers(data_dir):
    docs = data.load_wikitext(data_dir)
    assert docs[0]["page"].startswith("= Robert Boulter =")
    assert all(" @-@ " not in d["page"] for d in docs)


def test_resolution_order(tmp_path, monkeypatch):
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    monkeypatch.setenv(data.DATA_ENV_VAR, str(env_dir))
    assert data.resolve_data_dir(explicit) == explicit.resolve()
    assert data.resolve_data_dir() == env_dir.resolve()
    monkeypatch.delenv(data.DATA_ENV_VAR)
    default = tmp_path / "shared" / "data"
    default.mkdir(parents=True)
    monkeypatch.setattr(data, "REPO_ROOT", tmp_path / "repo")
    assert data.resolve_data_dir() == default.resolve()


def test_missing_directory_and_file_are_named(tmp_path):
    with pytest.raises(data.DataMissingError, match="nowhere"):
        data.resolve_data_dir(tmp_path / "nowhere")
    (tmp_path / "arc").mkdir()
    with pytest.raises(data.DataMissingError, match="arc_easy.jsonl"):
        data.check_task_files(tmp_path, ["driftgate_arc_easy"])


def test_an_unknown_task_is_named_with_the_known_ones(tmp_path):
    """Before any file is looked for: the misspelt name is the error, not a missing file of another task."""
    with pytest.raises(data.UnknownTaskError, match=r"unknown task 'driftgate_arc_eazy' in the policy; "
                                                     r"known tasks: driftgate_arc_challenge, driftgate_arc_easy, "):
        data.check_task_files(tmp_path, ["driftgate_arc_eazy", "driftgate_piqa"])
