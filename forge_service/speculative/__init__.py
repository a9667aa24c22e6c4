"""Speculative decoding: n-gram (prompt-lookup) drafts, verified in the normal batched step.

ngram.py: the incremental per-request index and the adaptive draft length. prediction.py: drafts
from a request's predicted output. proposer.py: the scheduler's per-request drafting state.
Verification lives in the model runner (`accepted_run`), rollback in the scheduler and the KV
cache manager (`trim`).
"""

from forge_service.speculative.ngram import AdaptiveDraftLength, NgramIndex

__all__ = ["AdaptiveDraftLength", "NgramIndex"]
