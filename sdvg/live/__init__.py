"""Live generation: an unbounded session whose prompt, seed and router threshold change between blocks
(docs/live.md). `LiveSession` (session.py) runs the blocks; `Update`/`UpdateAck` (updates.py) are what a
caller sends and gets back; `ConditioningTable` (conditioning.py) freezes each block's text conditioning."""
from sdvg.live.conditioning import ConditioningTable, PromptBank, blend_weights
from sdvg.live.session import LiveSession
from sdvg.live.updates import Update, UpdateAck, parse_schedule

__all__ = ["LiveSession", "Update", "UpdateAck", "ConditioningTable", "PromptBank", "blend_weights", "parse_schedule"]
