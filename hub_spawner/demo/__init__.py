"""The demo Hub: ``jupyterhub -f hub_spawner/demo/jupyterhub_config.py``."""
