"""dejavu.runtime.evaluation: how good an engine is, measured against its dense model.

`evaluate` (`dejavu-eval`: perplexity and zero-shot tasks, `eval_report` for `--report`),
`tasks` (task files and the one scorer every backend shares), `compare` (`dejavu-compare`:
engine vs dense through Polygraphy, with `polygraphy_runners`) and `lm_eval_adapter` (the
lm-evaluation-harness model). Imports nothing heavy: each tool imports torch after its
arguments were checked.
"""
