"""The quality evaluation behind ``tools/eval_quality.py`` and ``docs/quality.md``.

One module per job: ``texts`` (what is scored), ``methods`` (how keys/values are reconstructed and
what that costs in bits), ``protocol`` (running the model with a simulated cache), ``metrics``
(token KL, perplexity with a bootstrap interval, agreement), ``allocate`` (bits per layer and side
from measured sensitivity), ``disk_bits`` (bits per coordinate of real saved files), ``fit`` (the
allocation target or grid step that lands at an on-disk budget), ``report`` (markdown and plot),
``grid_study`` (rate on disk vs error of Lloyd–Max and uniform-grid codes on captured K/V, numpy).
"""
