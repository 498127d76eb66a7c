#!/bin/bash
read -r a b < /app/input.txt
echo $((a + b)) > /app/answer.txt
