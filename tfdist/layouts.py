"""Layout rules and presets for `tfdist.ModelParallelStrategy(rules=...)`.

>>> from tfdist import layouts
>>> rules = layouts.transformer() + layouts.LayoutRules([(r"head/kernel$", (None, "model"))])
>>> len(rules)
10
"""

from tfdist.placement.presets import auto
from tfdist.placement.presets import conv
from tfdist.placement.presets import data_parallel
from tfdist.placement.presets import transformer
from tfdist.placement.rules import LayoutRules
from tfdist.placement.rules import Rule

__all__ = ["LayoutRules", "Rule", "auto", "conv", "data_parallel", "transformer"]
