"""Placement: device meshes, the rules that map each variable to a layout on them (by path, attribute path
or role), and pipeline stages."""

from tfdist.placement import pipeline
from tfdist.placement.mesh import make_mesh
from tfdist.placement.mesh import mesh_axes
from tfdist.placement.rules import LayoutRules
from tfdist.placement.rules import Rule

__all__ = ["LayoutRules", "Rule", "make_mesh", "mesh_axes", "pipeline"]
