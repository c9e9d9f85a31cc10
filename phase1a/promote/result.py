"""The promote stage's result: the pointer as promotion left it (what phase1a/promote/promotion.py makes)."""
from __future__ import annotations

from pydantic import BaseModel

from phase1a.store.promoted import PromotedPointer


class PromotionOutcome(BaseModel):
    pointer: PromotedPointer
    promoted: bool  # False: the pointer already named this adapter, nothing was copied
