"""`podsrl compare` of configs whose models have different tokenizers: the report names each config's tokenizer
and flags the token counts, which are not one unit across them."""

from tests.journeys.user_kit import GRPO, ok, podsrl, user_config


def test_compare_names_each_tokenizer_and_flags_token_counts_of_different_ones(user_kit):
    bpe = user_config(user_kit, "bpe", "data/train.parquet", method=GRPO)
    chars = user_config(user_kit, "chars", "data/train.parquet", method=GRPO, model={"name_or_path": "tiny", "tiny": {"max_position_embeddings": 256}},
                        task={"args": {"path": "data/train.parquet", "answer_format": "gsm8k",
                                       "prompt_mode": "plain"}})
    out = user_kit / "cmp-tokenizers"
    done = ok(podsrl("compare", str(bpe), str(chars), "--seeds", "1", "--budget-rollouts", "16", "--out", str(out),
                     "--no-progress", cwd=user_kit))
    table = (out / "results.md").read_text()
    assert "**Token counts are not comparable across these configs: they count different tokenizers' tokens.**" \
        in table
    assert f"`bpe`: Qwen2Tokenizer of {user_kit / 'model'} (vocabulary 600, digest " in table
    assert "`chars`: Qwen2Tokenizer of tiny (vocabulary " in table
    assert "tokens gen / trained (each config's own tokenizer: not comparable)" in table
    assert "count tokens with different tokenizers" in done.stderr
    same = user_kit / "cmp-same"  # one tokenizer: named once per config, nothing flagged
    ok(podsrl("report", str(out / "bpe"), "--out", str(same), cwd=user_kit))
    table = (same / "results.md").read_text()
    assert f"Tokenizer (token counts are in its tokens): `bpe`: Qwen2Tokenizer of {user_kit / 'model'} " in table
    assert "not comparable" not in table
