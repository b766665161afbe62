"""The Lightning Trainer strategy and what both strategies (Trainer, Fabric) share."""
