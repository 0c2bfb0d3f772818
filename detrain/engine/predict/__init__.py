"""``detrain predict``: the predictor (``predictor``), the :class:`Results` it returns
(``results``) and the files it writes under a run folder (``output``).
"""
