"""The gateway's configuration: the typed config (``schema``), reading and validating the YAML file
(``loader``, with the field toolkit every section uses in ``fields``, and the ``classes:`` and
``store:`` sections in ``class_rules`` and ``stores``), what the config implies for the budget store
(``layout``) and per-model facts (``modeltable``).
"""
