"""Rerank and score (vLLM's `/rerank`, `/v1/rerank`, `/v2/rerank`, `/score`, `/v1/score`): each
query and document written into a yes/no template (template.py) and scored by the completions
path's `logprob_token_ids` on the answer's first position (scores.py), so a relevance score is
p(yes) from the same numbers that route reports."""
