"""Attacks on what privfl releases: reconstruction, membership inference and empirical DP audits.

Submodules are imported on demand (``from attacks.audit import audit_privatize``) so that importing one attack does
not pull in the dependencies of another.
"""
