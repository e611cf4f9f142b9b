"""The embedded tiny CPU base of ``--config-name tiny_cpu``: a locally built Llama and tokenizer
(``model.py``) warm-started on a toy verifiable task (``base.py``). Nothing is downloaded."""
