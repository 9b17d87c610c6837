"""lm-evaluation-harness model `dejavu`: evaluate an engine (or the dense model) with lm_eval.

    pip install lm_eval                        # 0.4.x; pulls no torch
    python -m dejavu.runtime.evaluation.lm_eval_adapter run --model dejavu \\
        --model_args model=opt-mini-0.3.engine,device=cpu --tasks piqa --limit 100

(`python -m` imports this module first, so `dejavu` is registered; in Python,
`import dejavu.runtime.evaluation.lm_eval_adapter` then `lm_eval.simple_evaluate(model="dejavu", ...)`.)

`model=` takes what `dejavu-eval` takes: a .engine file (scored with `Engine.logits`, or
through the decode loop with `path=decode` / `path=generate`, as `dejavu-eval --path`) or a
model name / folder (dense PyTorch). Scoring shares `dejavu.runtime.evaluation.tasks`: context and
continuation are tokenised separately, a BOS (`</s>`) is prepended, and the continuation's
log-probabilities are summed; rolling log-likelihood uses lm_eval's disjoint windows.
"""
from __future__ import annotations

import sys

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dejavu.errors import DejavuError
from dejavu.generation import GENERATION
from dejavu.runtime.evaluation.evaluate import EvalSettings, ScoringModel, load_scoring_model
from dejavu.runtime.evaluation.tasks import TokenizedPair, score_pairs, tokenize_pair


@register_model("dejavu")
class DejavuLM(LM):
    """lm_eval LM over a dejavu engine or dense model (log-likelihoods + greedy generation)."""

    def __init__(self, model: str | ScoringModel = "opt-mini", device: str = EvalSettings.device,
                 batch_size: int | str = EvalSettings.batch_size, max_gen_toks: int = GENERATION.max_new_tokens,
                 path: str = EvalSettings.path, **_ignored):
        super().__init__()
        self.sm = model if isinstance(model, ScoringModel) else load_scoring_model(str(model), device, path)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else EvalSettings.batch_size  # e.g. 'auto'
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        import torch

        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            extra.pop("device")  # lm_eval's default device is cuda; ours is cpu unless asked
        return cls(**{**extra, **dict(arg_dict or {})})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ helpers
    @property
    def eot_token_id(self) -> int:
        return self.sm.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return f"dejavu:{self.sm.name}"

    def _scores(self, pairs: list[TokenizedPair]):
        return score_pairs(self.sm.logits_fn, pairs, self.batch_size,
                           contexts_as_prompts=self.sm.info.get("path") == "generate")

    # ------------------------------------------------------------------ lm_eval API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy one) per request."""
        pairs = [tokenize_pair(self.sm.encode, ctx, cont, self.sm.bos_id, self.sm.max_len)
                 for ctx, cont in (r.args for r in requests)]
        return [(s.logprob, s.greedy) for s in self._scores(pairs)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum log-likelihood of each whole string (BOS-prefixed, disjoint max_len windows)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (text,) in (r.args for r in requests):
            ids = self.sm.encode(text)
            if not ids:
                out.append(0.0)
                continue
            pairs = []
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.sm.bos_id, max_seq_len=self.sm.max_len, context_len=1)):
                pairs.append(TokenizedPair(list(ctx) + list(pred), len(pred)))
            out.append(sum(s.logprob for s in self._scores(pairs)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut at the first `until` string."""
        import torch

        out = []
        for ctx, kwargs in (r.args for r in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = [self.sm.bos_id] + self.sm.encode(ctx)
            ids = ids[-max(1, self.sm.max_len - n_new):]
            new: list[int] = []
            text = ""
            for _ in range(n_new):
                window = (ids + new)[-self.sm.max_len:]
                logits = self.sm.logits_fn(torch.tensor([window]))  # [1, S, V]
                tok = int(logits[0, -1].argmax())
                if tok == self.eot_token_id:
                    break
                new.append(tok)
                text = self.sm.tokenizer.decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


def main(argv=None) -> None:
    """`lm_eval` command line with the `dejavu` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except DejavuError as e:
        print(f"dejavu: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
