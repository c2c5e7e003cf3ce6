"""Measuring drafters: the benchmark (``runner``, ``methods``, ``report``), ablation grids (``ablate``), tree
calibration per machine (``calibration``) and replay of recorded continuations (``replay``)."""
