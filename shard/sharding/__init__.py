"""How the model's logical axes land on a device mesh: mesh descriptions, rules, layouts, and the layout decisions the model and the planner share."""
