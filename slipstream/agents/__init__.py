"""Agent loops, tools, reward functions and prompt data; imports no other role (design.md §2)."""
