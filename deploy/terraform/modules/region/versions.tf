terraform {
  required_version = ">= 1.9"

  # Only the AWS provider: the module validates offline against a mirror of
  # it, and renders the files it hands on (the NATS configuration, the k8s
  # overlay's infra.env) with templatefile into outputs and user data.
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.100.0, < 6.0.0"
    }
  }
}
