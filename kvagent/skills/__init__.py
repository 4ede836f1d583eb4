"""Skills: YAML declarations compiled once per model to KV and transplanted into any context."""

from kvagent.skills.fidelity import FidelityGuard
from kvagent.skills.spec import SkillSpec, load_skill, load_skills

__all__ = ["FidelityGuard", "SkillSpec", "load_skill", "load_skills"]
