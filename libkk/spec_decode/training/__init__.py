"""Distilling a DFlash drafter from its target (`libkk train-drafter`): the drafter's side
(distill.py) and the target's (target.py). Nothing here runs while serving."""
