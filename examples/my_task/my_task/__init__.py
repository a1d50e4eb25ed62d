"""An example of your own task for Astra: data (../data), a reward and a workflow.

Used by name from a recipe (../recipe.yaml) as dotted paths on PYTHONPATH, or by
short name once installed (`pip install -e examples/my_task`: ../pyproject.toml
declares the entry points).
"""
