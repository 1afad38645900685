"""Engram: a lookup table split over the ranks of one scale-up domain."""
