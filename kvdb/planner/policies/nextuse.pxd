# compiled as it is (setup.py): no declarations; its per-call code gains from compilation alone
