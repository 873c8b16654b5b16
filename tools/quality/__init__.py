"""The quality evaluation behind ``tools/eval_quality.py`` and ``docs/quality.md``.

One module per job: ``texts`` (what is scored), ``methods`` (how keys/values are reconstructed and
what that costs in bits), ``protocol`` (running the model with a simulated cache), ``metrics``
(token KL, perplexity with a bootstrap interval, agreement), ``allocate`` (bits per layer and side
from measured sensitivity), ``report`` (markdown and plot).
"""
