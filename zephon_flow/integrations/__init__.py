"""Training-framework integrations: zephon-flow inside the trainers people already use.

Each module imports its framework, so none is imported here; import the one you use::

    from zephon_flow.integrations.hf import ZephonTrainer        # Hugging Face Trainer, accelerate

``docs/frameworks.md`` has the recipes.
"""
