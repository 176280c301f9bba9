"""EAGLE-3 as a drafter: the head and its SpecForge-layout files (head.py, config.py), the
drafter that runs one in generate() (draft.py), and the head shipped for the default model in a
source checkout (heads/; not in the wheel). Training a head is specfast.train."""

from specfast.drafters.eagle.config import EagleConfig
from specfast.drafters.eagle.draft import EagleDraft
from specfast.drafters.eagle.files import load_eagle, save_eagle
from specfast.drafters.eagle.head import EagleHead

__all__ = ["EagleConfig", "EagleDraft", "EagleHead", "load_eagle", "save_eagle"]
