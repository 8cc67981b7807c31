"""The podvm guest agent."""
