"""The GSM8K and MATH presets agree with themselves: a completion written the way the preset's own system prompt
asks scores the full reward of every reward function the preset lists, and the answer is read where the prompt
puts it (the last <answer> block, else the last \\boxed{}). Local fixture files in each dataset's column layout
stand in for the hub datasets."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from podsrl.config import load_config
from podsrl.math_verify_pool import MathVerifyPool
from podsrl.rewards import build_reward_manager
from podsrl.tasks import build_task

ROOT = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# One problem per dataset, in its own columns: the gold answer is 1/2 (MATH) or 18 (GSM8K).
FIXTURES = {
    "gsm8k": {"question": "Janet has 20 eggs and eats 2. How many are left?", "answer": "20-2=18\n#### 18"},
    "math": {"problem": "What is $\\frac{1}{4}+\\frac{1}{4}$?", "solution": "Add them: $\\boxed{\\frac{1}{2}}$."},
}
GOLD_TEXT = {"gsm8k": "18", "math": "\\dfrac{1}{2}"}  # as a model would write it
PRESETS = ["gsm8k_qwen_grpo", "gsm8k_qwen_pods", "math_qwen_grpo", "math_qwen_pods"]


@pytest.fixture(scope="module")
def pool():
    p = MathVerifyPool(workers=1, item_timeout_s=20.0)
    yield p
    p.close()


def chat_tokenizer():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=CHATML)


def preset_on_fixture(preset, tmp_path):
    """The preset with its dataset swapped for a one-problem local file (eval set off: nothing to hold out)."""
    data = preset.split("_")[0]
    path = tmp_path / f"{data}.jsonl"
    path.write_text(json.dumps(FIXTURES[data]) + "\n")
    cfg = load_config(ROOT / "configs" / f"{preset}.yaml",
                      [f"task.args.path={path}", "task.args.config=null", "task.args.eval_split=null",
                       "task.args.eval_path=null", "task.eval_size=0"])
    task = build_task(cfg.task, chat_tokenizer())
    return cfg, task, data


def follow_instructions(prompt: str, answer: str) -> str:
    """The completion the system prompt asks for, built from the prompt itself: its think/answer layout with
    the placeholders filled in, or its \\boxed{} filled in."""
    if "<answer>" in prompt:
        layout = prompt[prompt.rindex("<think>"): prompt.rindex("</answer>") + len("</answer>")]
        inside = layout[layout.index("<answer>") + len("<answer>"): layout.index("</answer>")].strip()
        return layout.replace("reasoning", "20 - 2 is 18, since she eats two.").replace(inside, answer)
    assert "\\boxed{}" in prompt, "the prompt asks for neither an <answer> block nor a \\boxed{} answer"
    return "Each quarter adds up: 1/4 + 1/4 = 2/4, which simplifies. So the answer is \\boxed{" + answer + "}."


def score(cfg, task, pool, completions):
    manager = build_reward_manager(cfg.rewards, task, pool=pool)
    problems = task.train_problems
    return manager.score(problems, torch.zeros(len(completions), dtype=torch.long), completions)


@pytest.mark.parametrize("preset", PRESETS)
def test_following_the_preset_prompt_earns_every_reward(preset, tmp_path, pool):
    cfg, task, data = preset_on_fixture(preset, tmp_path)
    (problem,) = task.train_problems
    question = FIXTURES[data].get("question") or FIXTURES[data]["problem"]
    assert cfg.task.args["system_prompt"] in problem.prompt and question in problem.prompt
    completion = follow_instructions(problem.prompt, GOLD_TEXT[data])
    result = score(cfg, task, pool, [completion, completion.replace(GOLD_TEXT[data], "7")])
    assert set(result.components) == {r if isinstance(r, str) else r["name"] for r in cfg.rewards}
    for name, values in result.components.items():
        assert values[0].item() == 1.0, f"{preset}: {name} gives {values[0].item()} to {completion!r}"
    assert result.correct.tolist() == [True, False]


@pytest.mark.parametrize("layout", [
    "<think>\n20 - 2 = 18\n</think>\n<answer>\n18\n</answer>\n",    # the layout with newlines
    "<think> 20 - 2 = 18 </think> <answer> 18 </answer>",           # the same, written on one line
    "<think>20 - 2 = 18</think><answer>18</answer>",
])
def test_gsm8k_format_reward_takes_either_whitespace(layout, tmp_path, pool):
    cfg, task, _ = preset_on_fixture("gsm8k_qwen_grpo", tmp_path)
    result = score(cfg, task, pool, [layout])
    assert result.components["format"].item() == 1.0 and result.correct.item()


def test_boxed_answer_is_read_without_answer_tags(tmp_path, pool):
    cfg, task, _ = preset_on_fixture("gsm8k_qwen_pods", tmp_path)
    result = score(cfg, task, pool, ["She has 20 and eats 2, 20 - 2 = 18, so \\boxed{18}. Check: 18 + 2 = 20.",
                                     "<think>18?</think><answer>17</answer> although \\boxed{18}"])
    assert result.correct.tolist() == [True, False]  # an <answer> block, when there is one, decides
    assert result.components["format"].tolist() == [0.0, 0.0]  # text after </answer> breaks the layout
